"""The random models the step, placement and e2e benches train (a preset's real layer shapes,
fewer layers), and the record a step or placement run writes.

Shared by the step worker (``step.py``), the placement driver (``placement.py``) and the e2e
bench (``e2e_assets.py``): here, not in one of them, so that none imports another's driver.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

LORA_RANK, LORA_ALPHA = 8, 16

# (transformers model_type, config of the real model with `num_hidden_layers` = the real count)
MODEL_CONFIGS: dict[str, tuple[str, dict]] = {
    "tiny": (
        "qwen3_moe",
        dict(
            hidden_size=256,
            intermediate_size=512,
            moe_intermediate_size=128,
            num_experts=8,
            num_experts_per_tok=2,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            vocab_size=1024,
        ),
    ),  # fmt: skip
    "qwen3-30b-a3b": (
        "qwen3_moe",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            vocab_size=151936,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
    ),  # fmt: skip
    "deepseek-v2-lite": (
        "deepseek_v2",
        dict(
            hidden_size=2048,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            n_routed_experts=64,
            n_shared_experts=2,
            num_experts_per_tok=6,
            first_k_dense_replace=1,
            num_hidden_layers=27,
            num_attention_heads=16,
            num_key_value_heads=16,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            head_dim=64,
            vocab_size=102400,
            topk_method="greedy",
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
        ),
    ),  # fmt: skip
}


def _real_width() -> None:
    """The flagship presets (``real_width.REAL_WIDTH``: one definition) in ``MODEL_CONFIGS`` too."""
    from kt_ft.integrations.bench.real_width import REAL_WIDTH  # why: torch loads with it

    MODEL_CONFIGS.update({name: (t, cfg) for name, (t, cfg, _) in REAL_WIDTH.items()})


_real_width()


@dataclass
class StepRecord:
    name: str  # system, e.g. "kt-ft[torch]", "peft-gpu", "offload"
    kind: str  # "step"
    preset: str
    tokens: int  # tokens per step
    seconds: float  # best step time
    tok_s: float | None
    layers: int
    real_layers: int
    peak_gpu_bytes: int | None
    peak_rss_bytes: int
    losses: list[float] = field(default_factory=list)
    note: str = ""
    cap_gib: float | None = None  # placement bench: the GPU memory cap of the full model
    predicted_s: float | None = None  # placement bench: the cost model's step time


def build_model_dir(preset: str, layers: int, out: Path, seed: int = 0) -> tuple[Path, float]:
    """Save a random bf16 model of ``preset`` with ``layers`` decoder layers; returns (dir, the
    share of the full model's parameter count these layers hold)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kt_ft.integrations.bench.real_width import (  # why: torch loads with it
        REAL_WIDTH,
        config_for,
        write_random_checkpoint,
    )

    if preset in REAL_WIDTH:  # too large to build whole: written shard by shard as distributed
        with torch.device("meta"):
            n = sum(
                p.numel() for p in AutoModelForCausalLM.from_config(config_for(preset, layers)).parameters()
            )
            n_full = sum(
                p.numel()
                for p in AutoModelForCausalLM.from_config(
                    config_for(preset, REAL_WIDTH[preset][1]["num_hidden_layers"])
                ).parameters()
            )
        write_random_checkpoint(preset, layers, out, seed=seed)
        return out, n / n_full
    model_type, cfg = MODEL_CONFIGS[preset]
    real_layers = cfg["num_hidden_layers"]
    config = AutoConfig.for_model(model_type, **{**cfg, "num_hidden_layers": layers})
    full = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    with torch.device("meta"):
        n_full = sum(p.numel() for p in AutoModelForCausalLM.from_config(full).parameters())
    # random init on the GPU where there is one: on the CPU it takes minutes for a dozen
    # Qwen3-30B-A3B layers (save_pretrained copies the tensors back); every system loads this file
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the workers (own processes) get the whole GPU
    assert real_layers >= layers
    return out, n / n_full
