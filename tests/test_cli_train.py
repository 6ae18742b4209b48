"""End to end: `llamafactory-cli train` on the demo recipe, as a user runs it (a subprocess)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.families import moe_layers
from safetensors import safe_open
from transformers import AutoConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from kt_ft.integrations.demo.text import make_demo_model
from kt_ft.plan.families import FAMILIES

pytest.importorskip("llamafactory")
REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "demo_tiny_qwen3moe.yaml"


def train_cli(assets: Path, out: Path, *extra: str) -> str:
    """`llamafactory-cli train` on the demo recipe with the assets of ``assets``; returns its log."""
    cli = Path(sys.executable).with_name("llamafactory-cli")
    overrides = [
        f"model_name_or_path={assets / 'model'}",
        f"dataset_dir={assets / 'data'}",
        f"output_dir={out}",
    ]
    proc = subprocess.run(
        [str(cli), "train", str(RECIPE), *overrides, *extra],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
        timeout=600,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    return log


@pytest.fixture(scope="module")
def demo_run(demo_assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("train") / "out"
    return out, train_cli(demo_assets, out)


def fused_tensors(path: Path) -> dict:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.lf_subprocess
def test_checkpoints_hold_split_artifacts(demo_run):
    out, _ = demo_run
    E, H, I, r = 8, 64, 32, 8
    shapes = {"gate_lora_a": (E, r, H), "gate_lora_b": (E, I, r), "up_lora_a": (E, r, H), "up_lora_b": (E, I, r),
              "down_lora_a": (E, r, I), "down_lora_b": (E, H, r)}  # fmt: skip
    for d in (out / "checkpoint-10", out / "checkpoint-20", out):
        names = (
            "adapter_config.json",
            "adapter_model.safetensors",
            "fused_expert_lora.safetensors",
            "kt_expert_lora_master.safetensors",
        )
        for name in (*names, "kt_adapter_manifest.json"):
            assert (d / name).is_file(), d / name
        fused = fused_tensors(d / "fused_expert_lora.safetensors")
        assert set(fused) == {f"layers.{L}.experts.{n}" for L in (0, 1) for n in shapes}
        for key, t in fused.items():
            assert t.dtype == torch.bfloat16, key  # KTransformers' interchange dtype
            assert tuple(t.shape) == shapes[key.split(".")[-1]], key
        with safe_open(str(d / "adapter_model.safetensors"), "pt") as f:
            keys = list(f.keys())
        assert keys and all("lora_" in k for k in keys)
        assert not any(".experts." in k for k in keys), "expert LoRA leaked into the PEFT file"
    # a checkpoint's manifest is written last, over the trainer's files too (kt-ft's on_save callback)
    listed = set(json.loads((out / "checkpoint-10" / "kt_adapter_manifest.json").read_text())["files"])
    assert {*names, "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= listed, listed
    assert set(json.loads((out / "kt_adapter_manifest.json").read_text())["files"]) == set(names)
    final = fused_tensors(out / "fused_expert_lora.safetensors")
    for key, t in final.items():
        if key.endswith("_b"):
            assert t.abs().max() > 0, f"{key} is still zero: expert LoRA did not train"


@pytest.mark.lf_subprocess
def test_loss_goes_down_and_logs_say_what_went_where(demo_run):
    out, log = demo_run
    losses = [
        json.loads(line)["loss"]
        for line in (out / "trainer_log.jsonl").read_text().splitlines()
        if '"loss"' in line
    ]
    assert len(losses) >= 5 and losses[-1] < losses[0], losses
    assert re.search(
        r"\[kt-ft\|INFO\] 8 experts x 2 MoE layers on cpu via backend torch .* with 2 threads", log
    )
    expert_lora = 2 * 8 * (8 * 64 * 2 + 32 * 8 * 2 + 8 * 32 + 64 * 8)
    assert f"expert-LoRA params {expert_lora:,}" in log
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        peft_params = sum(f.get_slice(k).get_shape()[0] * f.get_slice(k).get_shape()[1] for k in f.keys())
    assert f"trainable params: {peft_params + expert_lora:,}" in log


@pytest.mark.lf_subprocess
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "qwen3_moe"])
def test_llamafactory_cli_trains_each_family(family, tmp_path):
    """`llamafactory-cli train` on the family's demo model: 4 steps, both artifacts, expert LoRA
    of the MoE layers (only) trained. qwen3_moe gets the detailed checks above."""
    if FAMILIES[family].demo_type not in CONFIG_MAPPING:
        pytest.skip(f"{family}: model type {FAMILIES[family].demo_type!r} is not in this transformers")
    assets = make_demo_model(tmp_path / "demo", family=family)
    out = tmp_path / "out"
    train_cli(assets, out, "max_steps=4", "save_steps=4", "logging_steps=1")
    config = AutoConfig.from_pretrained(assets / "model")
    fused = fused_tensors(out / "fused_expert_lora.safetensors")
    layers = sorted({int(k.split(".")[1]) for k in fused})
    assert layers == moe_layers(config.get_text_config()), layers
    assert all(fused[f"layers.{L}.experts.down_lora_b"].abs().max() > 0 for L in layers)
    losses = [
        json.loads(x)["loss"] for x in (out / "trainer_log.jsonl").read_text().splitlines() if '"loss"' in x
    ]
    assert len(losses) == 4 and all(map(math.isfinite, losses))


@pytest.mark.lf_subprocess
def test_placement_auto_through_llamafactory(demo_assets, tmp_path):
    """A recipe whose rule says `placement: auto` trains through `llamafactory-cli train` (the
    planner at load, the run's re-planner and its CPU-rate check each step); on a machine without
    CUDA there is no link or GPU rate, so every expert stays on the CPU, and the log says so."""
    rule = tmp_path / "auto.yaml"
    rule.write_text(
        "- match: {class: Qwen3MoeExperts}\n  replace: {device: cpu, backend: torch, placement: auto}\n"
        "- include: qwen3_moe\n"
    )
    out = tmp_path / "out"
    log = train_cli(
        demo_assets, out, f"kt_optimize_rule={rule}", "max_steps=4", "save_steps=4", "logging_steps=1"
    )
    assert "placement: auto for 2 MoE layers" in log, log[-3000:]
    if not torch.cuda.is_available():
        assert "every routed expert on the CPU" in log, log[-3000:]
    assert (out / "fused_expert_lora.safetensors").is_file()


def test_gpu_placements_train_like_the_cpu_through_llamafactory(demo_assets, tmp_path):
    """Resident, streamed and CPU experts in each layer (on the CPU as the "device": a rule's `cuda` falls back to it
    without CUDA; the split, the device products and their LoRA caches run as on a GPU) against
    every expert on the CPU, through `llamafactory-cli train` with its default optimizer (fused
    AdamW, which leaves version counters alone: a LoRA cache keyed on them alone kept step 1's LoRA
    and parted the losses from step 2 on by ~1e-3). fp32, lr 1e-2 so the LoRA moves; losses of 4
    steps and the adapters within lf_runs' bounds."""
    from helpers.lf_runs import assert_close_runs

    runs = {}
    # one run holds every cache: a resident expert (bf16 cast), streamed ones (their rows) and CPU
    # experts beside them (the CPU op's host mirror of the LoRA)
    for name, experts in (("cpu", None), ("mixed", "gpu_experts: 1, stream: 4")):
        extra = [
            "max_steps=4",
            "save_steps=4",
            "logging_steps=1",
            "learning_rate=1.0e-2",
            "adam_epsilon=1.0e-3",
        ]
        if experts is not None:
            rule = tmp_path / f"{name}.yaml"
            rule.write_text(
                "- match: {class: Qwen3MoeExperts}\n"
                f"  replace: {{device: cpu, backend: torch, {experts}}}\n"
                "- include: qwen3_moe\n"
            )
            extra.append(f"kt_optimize_rule={rule}")
        train_cli(demo_assets, tmp_path / name, *extra)
        runs[name] = tmp_path / name
    assert_close_runs(runs["mixed"], runs["cpu"], [1, 2, 3, 4])
