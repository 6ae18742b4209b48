"""``kt_ft.apply`` (kt_ft/runtime/core.py) on a plain transformers + PEFT model, no LLaMA-Factory: the run
trains like transformers + PEFT with the same expert LoRA computed by a plain loop (test_parity.py's
reference and tolerances: fp32 losses rel 1e-5, expert LoRA 1e-4 abs), and its KTRun says what it did."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.parity import ATTN, PlainLoRAExperts, expert_lora, train
from helpers.tiny_models import tiny_model
from peft import LoraConfig, get_peft_model

import kt_ft
from kt_ft.base.errors import KTConfigError
from kt_ft.formats.lora_layout import LORA_NAMES
from kt_ft.plan.family import unwrap_peft


def _plain_twin(model, ref, run) -> None:
    """Give the expert LoRA of ``run`` (kt-ft's, on ``model``) non-zero B, so the expert-LoRA path
    counts from the first step, and put the same LoRA, computed by helpers.parity's plain loop, in
    the experts of ``ref`` (a copy of ``model`` made before ``kt_ft.apply``)."""
    with torch.no_grad():
        for n, p in run.expert_lora():
            if n.endswith("_b"):
                p.normal_(0, 0.05)
    for name, m in model.named_modules():
        if hasattr(m, "runner"):
            parent_name, _, child = name.rpartition(".")
            parent = ref.get_submodule(parent_name)
            copies = {n: getattr(m, n).detach() for n in LORA_NAMES}
            plain = PlainLoRAExperts(unwrap_peft(getattr(parent, child)), copies, m.scaling, m.spec)
            setattr(parent, child, plain)


def test_apply_on_a_plain_peft_model_trains_like_the_reference():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"seed {seed}")
    torch.manual_seed(seed)
    batches = [torch.randint(1, 97, (2, 12)) for _ in range(3)]
    model = get_peft_model(tiny_model(), LoraConfig(r=4, lora_alpha=8, target_modules=ATTN, lora_dropout=0.0))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    ref = copy.deepcopy(model)
    config = kt_ft.KTConfig(rule="qwen3_moe-torch", rank=4, alpha=8, threads=1, chunk_size=4096, seed=1)
    run = kt_ft.apply(model, config)
    assert run.rule_path.name == "qwen3_moe-torch.yaml" and run.replanner is None and run.auto is None
    assert run.summary.backend == "torch" and run.summary.layers == [0, 1]
    lora = dict(run.expert_lora())
    assert len(lora) == 6 * 2 and all(p.requires_grad for p in lora.values())
    _plain_twin(model, ref, run)
    got, want = train(model, batches, 4, gc=True), train(ref, batches, 4, gc=True)
    assert run.step(1) is False  # no placement: auto layer: nothing to re-plan
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    a, b = expert_lora(model), expert_lora(ref)
    assert a.keys() == b.keys() and a
    for k in a:
        # atol 5e-4: AdamW scales each update by 1 / sqrt(v), so an fp32 rounding difference in a
        # near-zero gradient moves an entry by up to ~lr; seed 40755742 moved one of 2,048 by 1.2e-4
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=5e-4, msg=k)


def test_apply_under_the_hf_trainer_trains_like_the_reference(tmp_path):
    """The README's second route: ``kt_ft.apply`` then an HF ``Trainer`` as shipped (its default
    optimizer, fused AdamW, which leaves version counters alone; no LLaMA-Factory). kt-ft's experts
    train like the plain-loop experts under the same Trainer, seed and batches: losses rel 1e-5,
    expert LoRA 1e-4 abs (test_parity.py's bounds); the run's callback is called each step."""
    from transformers import Trainer, TrainingArguments

    from kt_ft.integrations.trainer import KTCallback

    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"seed {seed}")
    torch.manual_seed(seed)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(1, 97, (8, 12))]
    model = get_peft_model(tiny_model(), LoraConfig(r=4, lora_alpha=8, target_modules=ATTN, lora_dropout=0.0))
    ref = copy.deepcopy(model)
    run = kt_ft.apply(model, kt_ft.KTConfig(rule="qwen3_moe-torch", rank=4, alpha=8, threads=1, seed=1))
    _plain_twin(model, ref, run)
    steps = []

    class Count(kt_ft.runtime.core.KTRun):  # counts the callback's calls through the run's own step
        def step(self, global_step):
            steps.append(global_step)
            return super().step(global_step)

    model._kt_ft_run = Count(
        run.model, run.plan, run.summary, run.rule_path, run.auto, run.replanner, run.info
    )

    def fit(m, callbacks, out):
        args = TrainingArguments(
            output_dir=str(tmp_path / out), per_device_train_batch_size=2, max_steps=4, learning_rate=1e-2,
            logging_steps=1, report_to=[], use_cpu=True, seed=seed, save_strategy="no", lr_scheduler_type="constant",
        )  # fmt: skip
        trainer = Trainer(model=m, args=args, train_dataset=rows, callbacks=callbacks)
        assert args.optim == "adamw_torch_fused"
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    got = fit(model, [KTCallback()], "kt")
    want = fit(ref, [], "ref")
    assert steps == [1, 2, 3, 4]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    a, b = expert_lora(model), expert_lora(ref)
    assert a.keys() == b.keys() and a
    for k in a:
        # atol 5e-4: AdamW scales each update by 1 / sqrt(v), so an fp32 rounding difference in a
        # near-zero gradient moves an entry by up to ~lr; seed 40755742 moved one of 2,048 by 1.2e-4
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=5e-4, msg=k)


def test_pure_bf16_expert_lora_trains_like_the_fp32_one():
    """``KTConfig(lora_dtype=bfloat16)`` (what LLaMA-Factory's ``pure_bf16`` sets): the expert LoRA,
    its grads and AdamW's moments are bf16 (8 bytes a parameter, ``rules plan --pure-bf16``), it
    starts from the fp32 LoRA's values rounded, and three AdamW steps track the fp32 run: losses
    within rel 1e-3, each tensor's update (after - before) within 20% of the fp32 update's norm
    (measured 7-9%: bf16's spacing at the A values, ~1e-3, against lr 1e-2 steps; AdamW's first
    steps move a parameter by about +-lr whatever its gradient's size, so the few tiny gradients
    whose sign bf16 rounding flips differ by 2 lr: an elementwise bound says little)."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"seed {seed}")
    torch.manual_seed(seed)
    batches = [torch.randint(1, 97, (2, 12)) for _ in range(3)]
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model()
        if not runs:
            start = copy.deepcopy(model.state_dict())
        else:
            model.load_state_dict(start)  # the same base weights in both runs
        config = kt_ft.KTConfig(rule="qwen3_moe-torch", rank=4, alpha=8, threads=1, seed=1, lora_dtype=dtype)
        run = kt_ft.apply(model, config)
        with torch.no_grad():
            for n, p in run.expert_lora():
                if n.endswith("_b"):  # the same non-zero B in both runs (drawn in fp32, then rounded)
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) * 0.05)
        lora = dict(run.expert_lora())
        assert lora and all(p.dtype == dtype for p in lora.values())
        before = {n: p.detach().float().clone() for n, p in lora.items()}
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for ids in batches:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            assert all(p.grad.dtype == dtype for p in lora.values())
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert all(opt.state[p]["exp_avg"].dtype == dtype for p in lora.values())
        runs[dtype] = (losses, {n: p.detach().float() - before[n] for n, p in lora.items()})
    (l32, d32), (l16, d16) = runs[torch.float32], runs[torch.bfloat16]
    print("losses fp32 / bf16 LoRA:", l32, l16)
    torch.testing.assert_close(torch.tensor(l16), torch.tensor(l32), rtol=1e-3, atol=0)
    for n in d32:
        rel = float((d16[n] - d32[n]).norm() / d32[n].norm())
        print(f"{n}: update differs by {rel:.3f} of its norm")
        assert rel < 0.2, (n, rel)


def test_apply_names_a_missing_rule():
    model = tiny_model()
    with pytest.raises(
        KTConfigError,
        match="rule='no_such_rule': no such file and no built-in rule of that name; built-in rules: ",
    ):
        kt_ft.apply(model, kt_ft.KTConfig(rule="no_such_rule"))


def test_easily_swapped_arguments_are_keyword_only():
    """rank and alpha (a past bug swapped them), the planner's rank / tokens / budget, a rule's and
    a summary's many fields: by name only."""
    from kt_ft.formats.lora_layout import lora_scaling
    from kt_ft.plan.cost import Rates
    from kt_ft.plan.loader import Rule
    from kt_ft.plan.splits import choose_splits
    from kt_ft.runtime.patch import KTSummary

    assert lora_scaling(rank=8, alpha=16) == 2.0
    assert lora_scaling(rank=4, alpha=8, use_rslora=True) == 4.0
    for call in (
        lambda: lora_scaling(8, 16),
        lambda: choose_splits([], Rates(cpu_flops=1.0), 8, 64, None),
        lambda: Rule(0, "x.yaml:1", None, None, "cpu", None, None, True),
        lambda: KTSummary([0], 8, "torch", "", 1, 0, 0, torch.device("cpu")),
    ):
        with pytest.raises(TypeError):
            call()


MIXED_RULE = (  # 2 resident and 3 streamed experts per layer beside the CPU op (the "GPU" is the CPU here)
    "- match:\n    name: '^model\\.layers\\.\\d+\\.mlp\\.experts$'\n"
    "  replace:\n    device: cpu\n    backend: torch\n    gpu_experts: 2\n    stream: 3\n"
    "- default: {device: cuda}\n"
)


@pytest.mark.parametrize("placement", ["cpu op", "resident and streamed"])
def test_an_inference_mode_call_leaves_the_op_usable_outside_it(placement, tmp_path):
    """LLaMA-Factory's chat engine answers `chat` under torch.inference_mode and `stream_chat` in a
    thread under plain no_grad; training may follow in the same process. A first call in inference
    mode must not leave the op's persistent buffers and caches as inference tensors: the no_grad call
    after it gives the same logits, and a training step after both reaches the expert LoRA."""
    rule = "qwen3_moe-torch"
    if placement != "cpu op":
        rule = tmp_path / "rule.yaml"
        rule.write_text(MIXED_RULE)
    torch.manual_seed(0)
    ids = torch.randint(1, 97, (2, 10))
    model = get_peft_model(tiny_model(), LoraConfig(r=4, lora_alpha=8, target_modules=ATTN, lora_dropout=0.0))
    run = kt_ft.apply(model, kt_ft.KTConfig(rule=str(rule), rank=4, alpha=8, threads=1, seed=1))
    model.eval()
    with torch.inference_mode():
        first = model(input_ids=ids).logits
    with torch.no_grad():
        second = model(input_ids=ids).logits
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in run.expert_lora()}
    assert all(g is not None for g in grads.values())
    assert any(g.abs().sum() > 0 for n, g in grads.items() if n.endswith("_b")), (
        "no gradient reached the expert LoRA"
    )
