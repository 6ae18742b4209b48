"""Per-family facts: which modules are the routed experts, and the tiny demo config.

transformers v5 stores routed experts fused (``gate_up_proj`` [E, 2I, H], ``down_proj``
[E, H, I]) and calls them as ``experts(hidden_states, top_k_index, top_k_weights)``; the
router, shared experts and dense layers are other modules that stay on the GPU path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import KTConfigError


@dataclass(frozen=True)
class MoEFamily:
    model_type: str  # transformers config.model_type
    experts_class: str  # class name of the fused routed-experts module
    activation: str  # config.hidden_act the CPU op implements
    builtin_rule: str  # optimize rule used when the recipe names none
    template: str  # LLaMA-Factory chat template for the real models
    demo_config: dict[str, Any] = field(default_factory=dict)


FAMILIES: dict[str, MoEFamily] = {
    "qwen3_moe": MoEFamily(
        model_type="qwen3_moe",
        experts_class="Qwen3MoeExperts",
        activation="silu",
        builtin_rule="qwen3_moe",
        template="qwen3",
        demo_config=dict(
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            max_position_embeddings=512,
            tie_word_embeddings=False,
            hidden_act="silu",
        ),
    ),
}

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def family_of(config) -> MoEFamily:
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise KTConfigError(
            f"model_type={model_type!r} is not supported by kt-ft yet; supported: {', '.join(FAMILIES)}"
        )
    return FAMILIES[model_type]


def layer_index(module_name: str) -> int:
    """Decoder-layer index from a dotted module name (`...layers.12.mlp.experts` -> 12)."""
    m = _LAYER_RE.search(module_name)
    if m is None:
        raise ValueError(f"no decoder-layer index in module name {module_name!r}")
    return int(m.group(1))


def find_routed_experts(model, family: MoEFamily) -> list[tuple[str, Any]]:
    """(dotted name, module) of every routed-experts module, in model order."""
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ == family.experts_class]
