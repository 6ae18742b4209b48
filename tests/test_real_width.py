"""The flagship presets' checkpoints (``kt_ft/integrations/bench/real_width.py``), at a reduced width.

DeepSeek-V3 as distributed (FP8: every projection but the router and ``lm_head``), Kimi K2 (INT4
routed experts) and Qwen3-235B-A22B (bf16) are written shard by shard with the hub's tensor names,
read back by kt-ft's format detection, and DeepSeek-V3 trains through ``llamafactory-cli train`` with
``use_kt: true`` (bf16, the ``native`` backend on its FP8 experts), writing a checkpoint that
``kt-ft convert`` reads, with the host peak (the run's max RSS) under the checkpoint's bytes + 4 GiB.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from kt_ft.backends.quant_detect import detect_format
from kt_ft.integrations.bench.real_width import REAL_WIDTH, config_for, write_random_checkpoint

REPO = Path(__file__).resolve().parents[1]
SMALL = {  # every width cut, the structure kept (MLA, shared expert, grouped routing, dense layer 0)
    "deepseek_v3": dict(
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        n_routed_experts=8,
        num_experts_per_tok=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=64,
        q_lora_rank=96,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        vocab_size=1024,
        n_group=2,
        topk_group=1,
    ),
    "qwen3_moe": dict(
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=1024,
    ),
}


def small(preset: str) -> dict:
    return SMALL[REAL_WIDTH[preset][0]]


def keys(model_dir: Path) -> dict[str, str]:
    return json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]


@pytest.mark.parametrize("preset", sorted(REAL_WIDTH))
def test_written_shard_by_shard_as_distributed(preset, tmp_path):
    out, written = write_random_checkpoint(
        preset, 2, tmp_path / "m", shard_bytes=1 << 18, overrides=small(preset)
    )
    cfg = json.loads((out / "config.json").read_text())
    fmt = detect_format(cfg, str(out / "config.json"))
    want = REAL_WIDTH[preset][2]
    assert (fmt.name if fmt else None) == want
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 3 and written == sum(p.stat().st_size for p in shards)  # many shards of ~256 KiB
    wmap = keys(out)
    e = 7  # the last expert of the MoE layer, per-expert names as the hub's files
    expert = f"model.layers.1.mlp.experts.{e}.gate_proj"
    with safe_open(str(out / wmap[next(k for k in wmap if k.startswith(expert))]), "pt") as f:
        names = {k for k in f.keys() if k.startswith(expert + ".")}
    stored = {
        "fp8": {"weight", "weight_scale_inv"},
        "int4": {"weight_packed", "weight_scale", "weight_shape"},
    }
    assert names == {f"{expert}.{n}" for n in stored.get(want, {"weight"})}
    dense_mlp = "model.layers.0.mlp.gate_proj.weight"
    if preset != "qwen3-235b-a22b":  # layer 0 dense (DeepSeek-V3 and Kimi K2), FP8 there too for V3
        assert dense_mlp in wmap and ("model.layers.0.mlp.gate_proj.weight_scale_inv" in wmap) == (
            want == "fp8"
        )
    assert "lm_head.weight" in wmap and "model.layers.1.mlp.gate.weight" in wmap  # never quantized
    assert config_for(preset, 2).num_hidden_layers == 2


@pytest.mark.lf_subprocess
def test_deepseek_v3_fp8_trains_through_llamafactory_and_converts(demo_assets, tmp_path):
    pytest.importorskip("llamafactory")
    model, written = write_random_checkpoint(
        "deepseek-v3", 2, tmp_path / "model", overrides=small("deepseek-v3")
    )
    for p in (demo_assets / "model").iterdir():  # the demo's tokenizer (vocab <= 1024)
        if p.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(p, model / p.name)
    out = tmp_path / "out"
    cli = Path(sys.executable).with_name("llamafactory-cli")
    overrides = [
        f"model_name_or_path={model}",
        f"dataset_dir={demo_assets / 'data'}",
        f"output_dir={out}",
        "bf16=true",
        "use_cpu=true",  # HF: bf16 on a machine without a GPU needs it
        "kt_backend=native",
        "max_steps=2",
        "save_steps=2",
        "cutoff_len=64",
        "per_device_train_batch_size=2",
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    proc = subprocess.run(
        [str(cli), "train", str(REPO / "recipes" / "demo_tiny_qwen3moe.yaml"), *overrides],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
        timeout=600,
    )
    log = proc.stdout + proc.stderr
    (tmp_path / "train.log").write_text(log)
    assert proc.returncode == 0, log[-4000:]
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    print(
        f"checkpoint {written / 2**20:.1f} MiB, training peak RSS {peak / 2**20:.0f} MiB (before: {before} KiB)"
    )
    assert peak <= written + (4 << 30)
    assert "via backend native" in log and "routed experts: " in log and " of fp8 " in log
    ckpt = out / "checkpoint-2"
    assert (ckpt / "fused_expert_lora.safetensors").is_file()
    conv = subprocess.run(
        [str(Path(sys.executable).with_name("kt-ft")), "convert", str(ckpt), str(tmp_path / "peft")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert conv.returncode == 0, conv.stdout + conv.stderr
    with safe_open(str(tmp_path / "peft" / "adapter_model.safetensors"), "pt") as f:
        assert any(".experts.7.down_proj.lora_B" in k for k in f.keys())
