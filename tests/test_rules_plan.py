"""`kt-ft rules plan` / `rules check --model`: numbers against a hand count on the tiny Qwen3-MoE.

The model directory holds only what `from_pretrained` needs (config.json, model.safetensors):
the plan reads the config and the safetensors header, never the weights.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.tiny_models import tiny_model

from kt_ft.backends.grouped_wide import wide_extra_bytes
from kt_ft.integrations.cli.main import main
from kt_ft.plan.report import CUDA_GROWTH_BYTES, CUDA_OVERHEAD_BYTES

# tiny_model("qwen3_moe"): H 64, 4 q heads / 2 kv heads of 16, 2 layers, 8 experts of I 32, top-2, V 97
H, L, E, I, V, K, R = 64, 2, 8, 32, 97, 2, 8
EXPERT_PARAMS = L * E * (2 * I * H + H * I)  # gate_up [E, 2I, H] + down [E, H, I]
PER_LAYER = (
    (64 * 64) + 2 * (64 * 32) + (64 * 64) + 2 * 16 + 2 * 64 + E * H
)  # q k v o, q/k norm, 2 norms, router
NON_EXPERT_PARAMS = 2 * V * H + L * PER_LAYER + H  # embeddings, lm_head, layers, final norm
PEFT_LORA = L * R * ((64 + 64) + 2 * (64 + 32) + (64 + 64))  # q k v o: r (in + out)
EXPERT_LORA = L * 3 * E * R * (H + I)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    tiny_model().save_pretrained(root / "fp32")
    tiny_model().to(torch.bfloat16).save_pretrained(root / "bf16")
    return root


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plan_numbers_match_a_hand_count(model_dirs, capsys):
    rc, out, _ = run_cli(
        capsys, "rules", "plan", "--rule", "qwen3_moe", "--model", str(model_dirs / "fp32"),
        "--cutoff-len", "16", "--batch", "2", "--lora-rank", "8", "--cpu-infer", "3", "--json",
    )  # fmt: skip
    assert rc == 0
    r = json.loads(out)
    assert r["dtype"] == "float32"
    assert r["lora"] == {"peft_params": PEFT_LORA, "expert_params": EXPERT_LORA}
    assert (PEFT_LORA, EXPERT_LORA) == (7_168, 36_864)  # README's demo line says the same
    cpu, gpu = r["devices"]["cpu"], r["devices"]["cuda:0"]
    assert cpu["param_bytes"] == EXPERT_PARAMS * 4
    assert gpu["param_bytes"] == NON_EXPERT_PARAMS * 4
    assert (cpu["train_state_bytes"], gpu["train_state_bytes"]) == (EXPERT_LORA * 16, PEFT_LORA * 16)
    T = 2 * 16
    # the loss: kt-ft's chunked one (models/lm_loss.py): a chunk's fp32 logits, their softmax and
    # 16-bit copy (2.5 x 4 bytes a logit, at most 2.5 x 128 MiB) and the hidden states' fp32 gradient
    loss = min(T * V * 4, 128 * 2**20) * 5 // 2 + T * H * 4
    assert gpu["activation_bytes"] == L * T * H * 4 + 17 * T * H * 4 + loss
    # the CPU op's saved set: gate/up pre-activations and the LoRA products of each routed pair plus
    # up to 15 padding rows an expert (fp32), the layer's bf16 input and fp32 output (kernels/grouped.py)
    rows = T * K + min(E, T * K) * 15
    assert cpu["activation_bytes"] == L * (rows * (2 * I + 3 * R) * 4 + T * H * (2 + 4))
    assert cpu["total_bytes"] == cpu["param_bytes"] + cpu["train_state_bytes"] + cpu["activation_bytes"]
    # the CUDA runtime outside PyTorch's allocator counts on the GPU only (estimated before any GPU work)
    assert (cpu["runtime_bytes"], gpu["runtime_bytes"]) == (0, CUDA_OVERHEAD_BYTES + CUDA_GROWTH_BYTES)
    assert gpu["total_bytes"] == sum(
        gpu[k] for k in ("param_bytes", "train_state_bytes", "activation_bytes", "runtime_bytes")
    )
    assert [(g["what"], g["how"]) for g in r["groups"]] == [
        ("layers 0-1 routed experts", "cpu auto 3 threads"),
        ("layers 0-1 attention, router, norms, dense/shared MLPs", "cuda:0"),
        ("outside the layers: embeddings, final norm, lm_head", "cuda:0"),
    ]


def test_plan_dtype_from_safetensors_and_budgets(model_dirs, capsys):
    rc, out, _ = run_cli(
        capsys, "rules", "plan", "--rule", "qwen3_moe", "--model", str(model_dirs / "bf16"),
        "--gpu-mem", "2", "--cpu-mem", "0.0001",
    )  # fmt: skip
    assert rc == 1  # the CPU budget (~105 KB) is too small
    assert "(bfloat16 weights; cutoff_len 2048, batch 1, lora_rank 8)" in out
    assert "layers 0-1 routed experts" in out and "LoRA parameters: PEFT (lora_target all) 7,168" in out
    cpu_line = next(line for line in out.splitlines() if line.strip().startswith("cpu "))
    gpu_line = next(line for line in out.splitlines() if line.strip().startswith("cuda:0 "))
    assert f"{EXPERT_PARAMS * 2 / 2**20:.2f} MiB" in cpu_line and cpu_line.endswith("NO")
    assert gpu_line.endswith("yes")


def test_plan_shows_gpu_experts_and_layer_split(model_dirs, tmp_path, capsys):
    rule = tmp_path / "r.yaml"
    rule.write_text(
        "- match: {class: Qwen3MoeExperts}\n  replace: {device: cpu, backend: torch, gpu_experts: {layers: 1, ids: [0, 3]}}\n"
        "- match: {layers: 1}\n  replace: {device: cuda:1}\n"
        "- default: {device: cuda:0}\n"
    )
    rc, out, _ = run_cli(
        capsys, "rules", "plan", "--rule", str(rule), "--model", str(model_dirs / "fp32"), "--json"
    )
    assert rc == 0
    r = json.loads(out)
    assert [g["what"] for g in r["groups"]][:2] == ["layers 0 routed experts", "layers 1 routed experts"]
    assert r["groups"][1]["how"] == "cpu torch 2 threads, gpu_experts ids [0, 3]"
    assert {g["what"]: g["device"] for g in r["groups"][2:]} == {
        "layers 0 attention, router, norms, dense/shared MLPs": "cuda:0",
        "layers 1 attention, router, norms, dense/shared MLPs": "cuda:1",
        "outside the layers: embeddings, final norm, lm_head": "cuda:0",
    }
    per_expert = EXPERT_PARAMS // (L * E) * 4
    assert r["devices"]["cpu"]["param_bytes"] == 2 * E * per_expert  # the CPU keeps every expert
    # a resident expert's copy on the GPU holds its expert LoRA's blocks beside it (grouped_wide.py)
    resident = per_expert + wide_extra_bytes(H, I, R, 4)
    assert r["devices"]["cuda:0"]["param_bytes"] == (2 * V * H + PER_LAYER + H) * 4 + 2 * resident
    assert r["devices"]["cuda:1"]["param_bytes"] == PER_LAYER * 4
    # layer 1 has GPU experts: its expert LoRA (and AdamW state) counts on the training GPU,
    # layer 0's stays on the CPU (placement/homes.py lora_home)
    half = EXPERT_LORA // L
    assert r["devices"]["cpu"]["lora_params"] == half
    assert (
        r["devices"]["cuda:0"]["lora_params"] == PEFT_LORA // L + half
    )  # layer 0's attention LoRA + layer 1's experts'
    # gpu_experts runs now (moe/resident.py): only the multi-device placement is refused
    assert len(r["refusals"]) == 1 and "multi-device placement" in r["refusals"][0]


def test_check_with_model_reports_every_problem(model_dirs, tmp_path, capsys):
    rule = tmp_path / "bad.yaml"
    rule.write_text(
        "- match: {class: Qwen3MoeExperts}\n  replace: {device: cpu}\n"
        "- match: {name: 'nothing_here'}\n  replace: {device: cpu}\n"
    )
    rc, out, err = run_cli(capsys, "rules", "check", str(rule), "--model", str(model_dirs / "fp32"))
    assert rc == 2 and out == ""
    assert f"{rule}:3: rule #2 (name=/nothing_here/) at {rule}:3 matches no module of this model" in err
    rc, out, _ = run_cli(capsys, "rules", "check", "qwen3_moe", "--model", str(model_dirs / "fp32"))
    assert rc == 0 and "matches " in out and "2 routed-experts modules: OK" in out


def test_check_lists_schema_include_and_device_problems_together(tmp_path, capsys):
    rule = tmp_path / "bad.yaml"
    rule.write_text(
        "- match:\n"
        "    clas: Qwen3MoeExperts\n"  # line 2
        "  replace:\n"
        "    device: cuda:3\n"  # line 4
        "    backend: amx\n"  # line 5
        "- include: nope.yaml\n"  # line 6
    )
    rc, out, err = run_cli(capsys, "rules", "check", str(rule))
    assert rc == 2 and out == "" and "kt-ft found 4 problems:" in err
    assert f"{rule}:2: [0].match.clas: unknown key (did you mean 'class'?)" in err
    assert f"{rule}:4: [0].replace.device: 'cuda:3' does not exist: this machine has " in err
    assert (
        f"{rule}:5: [0].replace.backend: 'amx'; valid choices: auto, torch, torch-ep, native, reference, kt-kernel"
        in err
    )
    assert f"{rule}:6: [1].include: 'nope.yaml': no file {tmp_path / 'nope.yaml'} and no built-in rule" in err


def test_lora_count_is_the_same_on_a_peft_wrapped_model():
    """placement: auto plans on the PEFT model during a run: its wrapped layers count once (not also
    their base_layer and lora_A / lora_B)."""
    from helpers.tiny_models import tiny_model
    from peft import LoraConfig, get_peft_model

    from kt_ft.plan.builtin import resolve_rule_path
    from kt_ft.plan.families import FAMILIES
    from kt_ft.plan.loader import load_rules
    from kt_ft.plan.placement import make_plan
    from kt_ft.plan.report import TrainSizes, estimate

    fam, rules = FAMILIES["qwen3_moe"], load_rules(resolve_rule_path("qwen3_moe"))
    sizes = TrainSizes(cutoff_len=64, batch=1, lora_rank=8)
    counts = []
    for wrap in (False, True):
        model = tiny_model("qwen3_moe")
        if wrap:
            model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))
        plan = make_plan(model, rules, fam, "torch", 2, planning_only=True)
        counts.append(estimate(model, plan, torch.float32, sizes)["lora"])
    assert counts[0] == counts[1] and counts[0]["peft_params"] > 0


def test_gpu_cap_too_small_stops_before_loading_with_what_would_fit(tmp_path):
    """``kt_gpu_memory`` below what the GPU needs with every auto expert on the CPU: the error (raised
    from the meta skeleton, before any weight is read) names the recipe, the key, the value, what the
    GPU needs and the smallest valid value; a cap at that value passes."""
    from kt_ft.base.errors import KTConfigError
    from kt_ft.formats.skeleton import meta_model
    from kt_ft.plan.family import family_of
    from kt_ft.plan.loader import load_rules
    from kt_ft.plan.placement import make_plan
    from kt_ft.plan.report import TrainSizes, check_gpu_cap, estimate

    model = meta_model(tiny_model().config, torch.bfloat16)
    rule = tmp_path / "auto.yaml"
    rule.write_text(
        "- match: {class: Qwen3MoeExperts}\n  replace: {device: cpu, backend: torch, placement: auto}\n"
        "- default: {device: cuda}\n"
    )
    rules = load_rules(rule)
    plan = make_plan(model, rules, family_of(model.config), "torch", 1)
    sizes = TrainSizes(64, 1, 8)
    need = estimate(model, plan, torch.bfloat16, sizes)["devices"]["cuda:0"]["total_bytes"] / 2**30
    with pytest.raises(KTConfigError) as err:
        check_gpu_cap(model, plan, torch.bfloat16, sizes, 0.5, "recipe.yaml")
    msg = str(err.value)
    assert (
        msg.startswith("kt-ft: recipe.yaml: kt_gpu_memory=0.5 cannot hold this run") and "CUDA runtime" in msg
    )
    assert f"still needs {need:.1f} GiB" in msg and f"valid: kt_gpu_memory >= {need:.1f}" in msg
    check_gpu_cap(model, plan, torch.bfloat16, sizes, need + 0.01, "recipe.yaml")
