"""The MoE families kt-ft supports, and the ones it refuses (with the reason).

Every supported family was checked against transformers 5.6's modeling file: its routed
experts are one fused module called as ``experts(hidden_states [T, H], top_k_index [T, k],
top_k_weights [T, k])`` with the routing weights already final (softmax / sigmoid, top-k
renormalisation, group-limited selection and ``routed_scaling_factor`` all happen in HF's
router code, which kt-ft leaves untouched). Shared experts, their sigmoid gate and dense MLP
layers are ordinary ``nn.Linear`` modules on the GPU path (PEFT LoRA).

Expert layouts (``MoEFamily.expert_layout``):

* ``fused_silu`` (all but gpt_oss): ``gate_up_proj`` [E, 2I, H] (rows :I gate, I: up),
  ``down_proj`` [E, H, I], no biases, ``act_fn = silu``: h = silu(g) * u;
* ``interface`` (families derived from transformers' experts interface, ``derived.py``): what
  ``interface.py`` reads off each module (its decorator flags and its ``_apply_gate``);
* ``gpt_oss`` (``GptOssExperts``): ``gate_up_proj`` [E, H, 2I] with gate/up interleaved (columns
  0::2 gate, 1::2 up), ``gate_up_proj_bias`` [E, 2I] (same column order), ``down_proj``
  [E, I, H], ``down_proj_bias`` [E, H], computed as x @ W + b; ``_apply_gate`` is a clamped
  swish, h = (clamp(u, -limit, limit) + 1) * gc * sigmoid(alpha * gc), gc = min(g, limit), with
  alpha = 1.702 and limit = 7 read from the module (the config's ``hidden_act`` and
  ``swiglu_limit`` are not read by transformers' experts). Its router (``GptOssTopKRouter``,
  a linear layer with bias) passes the top-k logits' softmax, [T, k].

Per family, ``demo_config`` is a tiny random model (hidden 64, 8 experts top-2, a small
vocab set by the caller) that keeps the family's structure: dense layers where the family
has them, shared experts, grouped routing, hybrid attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class MoEFamily:
    model_type: str  # transformers config.model_type of the real checkpoints
    experts_class: str  # class name of the fused routed-experts module
    # config.hidden_act the CPU op implements (silu-gated GLU); None: the family's experts do not
    # read hidden_act (gpt_oss hard-codes its activation, checked on the module instead)
    activation: str | None
    builtin_rule: str  # optimize rule used when the recipe names none
    template: str  # LLaMA-Factory chat template for the real (instruct) models
    recipe: str  # recipes/<recipe> for a real model of the family
    demo_config: dict[str, Any] = field(default_factory=dict)
    # other config.model_type values that are this family (e.g. a text-only config)
    aliases: tuple[str, ...] = ()
    # model_type the tiny demo/test model is built with (default: model_type); a text-only
    # type where the real checkpoint is a vision-language composite
    demo_model_type: str | None = None
    # how the routed experts store their weights and which activation they compute (module doc)
    expert_layout: str = "fused_silu"
    # other names the experts class has in other transformers versions (a rename keeps the layout)
    experts_class_aliases: tuple[str, ...] = ()

    @property
    def experts_classes(self) -> tuple[str, ...]:
        return (self.experts_class, *self.experts_class_aliases)

    @property
    def model_types(self) -> tuple[str, ...]:
        return (self.model_type, *self.aliases)

    @property
    def demo_type(self) -> str:
        return self.demo_model_type or self.model_type


# Attention shapes shared by the demo configs (4 heads of 16, GQA 2 kv heads).
_ATTN = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    hidden_act="silu",
)
# DeepSeek multi-head latent attention, tiny (q_lora_rank None = plain q_proj, as in V2-Lite).
_MLA = dict(
    _ATTN,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    head_dim=8,  # = qk_rope_head_dim: HF's rotary embedding uses head_dim
)

FAMILIES: dict[str, MoEFamily] = {
    "qwen3_moe": MoEFamily(
        model_type="qwen3_moe",
        experts_class="Qwen3MoeExperts",
        activation="silu",
        builtin_rule="qwen3_moe",
        template="qwen3",
        recipe="qwen3_30b_a3b.yaml",
        demo_config=dict(
            _ATTN,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        ),
    ),
    "qwen2_moe": MoEFamily(
        model_type="qwen2_moe",
        experts_class="Qwen2MoeExperts",
        activation="silu",
        builtin_rule="qwen2_moe",
        template="qwen",
        recipe="qwen2_57b_a14b.yaml",
        demo_config=dict(
            _ATTN,
            intermediate_size=128,  # dense MLP of mlp_only_layers
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,  # one shared expert behind a sigmoid gate
            num_hidden_layers=3,
            mlp_only_layers=[1],  # a dense layer in the middle: expert layers are 0 and 2
            decoder_sparse_step=1,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            qkv_bias=True,
        ),
    ),
    "deepseek_v2": MoEFamily(
        model_type="deepseek_v2",
        experts_class="DeepseekV2Experts",
        activation="silu",
        builtin_rule="deepseek_v2",
        template="deepseek",
        recipe="deepseek_v2_lite.yaml",
        demo_config=dict(
            _MLA,
            q_lora_rank=None,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            first_k_dense_replace=1,  # layer 0 dense, as in DeepSeek-V2(-Lite)
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            # greedy as in V2-Lite; transformers 5.6's group_limited_greedy (V2) reads a
            # missing attribute (DeepseekV2Moe.num_experts), see README "Known traps"
            topk_method="greedy",
            routed_scaling_factor=1.5,  # applied in HF's router: the experts get scaled weights
            norm_topk_prob=False,
        ),
    ),
    "deepseek_v3": MoEFamily(
        model_type="deepseek_v3",
        experts_class="DeepseekV3NaiveMoe",
        experts_class_aliases=("DeepseekV3Experts",),  # transformers 5.17
        activation="silu",
        builtin_rule="deepseek_v3",
        template="deepseek3",
        recipe="deepseek_v3.yaml",
        demo_config=dict(
            _MLA,
            q_lora_rank=32,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=4,  # sigmoid scores + e_score_correction_bias, 2 of 4 groups
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        ),
    ),
    "glm4_moe": MoEFamily(
        model_type="glm4_moe",
        experts_class="Glm4MoeNaiveMoe",
        experts_class_aliases=("Glm4MoeExperts",),  # transformers 5.17
        activation="silu",
        builtin_rule="glm4_moe",
        template="glm4_moe",
        recipe="glm4_5_air.yaml",
        demo_config=dict(
            _ATTN,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        ),
    ),
    "mixtral": MoEFamily(
        model_type="mixtral",
        experts_class="MixtralExperts",
        activation="silu",
        builtin_rule="mixtral",
        template="mistral",
        recipe="mixtral_8x7b.yaml",
        demo_config=dict(
            _ATTN,
            intermediate_size=32,  # Mixtral's experts use intermediate_size (no dense layers)
            num_hidden_layers=2,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
    ),
    "olmoe": MoEFamily(
        model_type="olmoe",
        experts_class="OlmoeExperts",
        activation="silu",
        builtin_rule="olmoe",
        template="olmo",
        recipe="olmoe_1b_7b.yaml",
        demo_config=dict(
            {k: v for k, v in _ATTN.items() if k != "head_dim"},  # OLMoE derives head_dim
            intermediate_size=32,
            num_hidden_layers=2,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
        ),
    ),
    "qwen3_5_moe": MoEFamily(
        model_type="qwen3_5_moe",
        experts_class="Qwen3_5MoeExperts",
        activation="silu",
        builtin_rule="qwen3_5_moe",
        template="qwen3_5",
        recipe="qwen3_5_moe.yaml",
        # the real checkpoints are vision-language composites (qwen3_5_moe, the language
        # model under model.language_model); the demo is the text-only model
        aliases=("qwen3_5_moe_text",),
        demo_model_type="qwen3_5_moe_text",
        demo_config=dict(
            _ATTN,
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],  # hybrid: Gated DeltaNet + attention
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
        ),
    ),
    "gpt_oss": MoEFamily(
        model_type="gpt_oss",
        experts_class="GptOssExperts",
        activation=None,
        builtin_rule="gpt_oss",
        template="gpt_oss",
        recipe="gpt_oss_20b.yaml",
        expert_layout="gpt_oss",
        demo_config=dict(
            _ATTN,
            intermediate_size=32,  # the experts' I (gpt_oss has no dense MLP layers)
            num_hidden_layers=2,
            layer_types=["sliding_attention", "full_attention"],  # alternating, as in gpt-oss
            sliding_window=8,  # shorter than the demo's sequences, so the window matters
            num_local_experts=8,
            num_experts_per_tok=2,
            attention_bias=True,
            # YaRN as in gpt-oss, with factor = max_position_embeddings / original (512 / 64)
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=8.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=64,
            ),
        ),
    ),
}

# Families whose routed experts kt-ft's CPU op does not compute (yet), and why.
UNSUPPORTED: dict[str, str] = {}
